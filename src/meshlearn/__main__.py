import sys

from meshlearn.cli import main

sys.exit(main())
