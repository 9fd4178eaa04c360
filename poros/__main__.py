import sys

from poros.cli import main

sys.exit(main())
