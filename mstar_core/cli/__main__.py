import sys

from mstar_core.cli import main

sys.exit(main())
