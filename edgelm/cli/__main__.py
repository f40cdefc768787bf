import sys

try:
    from edgelm.cli import main
except KeyboardInterrupt:  # Ctrl-C while Python was still importing: no traceback
    sys.exit(130)

sys.exit(main())
