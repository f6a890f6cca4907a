import sys

from hybridgemm.cli import main

# Guarded: the tuner's compile workers are spawned processes, which import the parent's
# __main__ module (as __mp_main__) and must not run the CLI again.
if __name__ == "__main__":
    sys.exit(main())
