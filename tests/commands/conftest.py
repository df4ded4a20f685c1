import sys
from pathlib import Path

# The command tests train the toy recipe of tests/recipes/toy.py.
sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
