"""``python -m vfio_cxl.devices.gpu serve ...`` (same as ``vfio-cxl gpu ...``)."""

import sys

from .serve import main

sys.exit(main())
