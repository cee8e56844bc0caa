"""``python -m vfio_cxl.gpu serve ...`` (same as ``vfio-cxl gpu ...``)."""

import sys

from .cli import main

sys.exit(main())
