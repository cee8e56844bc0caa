"""``python -m vfio_cxl.devices.smc serve ...`` (same as ``vfio-cxl smc ...``)."""

import sys

from .serve import main

sys.exit(main())
