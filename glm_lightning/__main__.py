import sys

from glm_lightning.cli import run

if __name__ == "__main__":
    sys.exit(run())
