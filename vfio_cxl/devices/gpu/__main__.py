"""``python -m vfio_cxl.devices.gpu serve ...`` (same as ``vfio-cxl gpu ...``)."""

import sys

from .cli import main

sys.exit(main())
