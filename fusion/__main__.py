import sys

from hybridgemm.cli import main

sys.exit(main())
