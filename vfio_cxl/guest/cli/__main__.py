"""``python3 -m vfio_cxl.guest.cli``: what the guest image's ``vfio-cxl`` wrapper runs.

The command lives in ``vfio_cxl.guest.cmd.cli``; this name stays because the
image's /usr/local/bin/vfio-cxl calls it, and changing that script changes the
image recipe (a new guest image).  Nothing in the library imports this package.
"""

import sys

from ..cmd.cli import main

sys.exit(main())
