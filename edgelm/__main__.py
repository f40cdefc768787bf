import sys

from edgelm.cli import main

sys.exit(main())
