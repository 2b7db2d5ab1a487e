import sys

from specprefill.cli import main

sys.exit(main())
