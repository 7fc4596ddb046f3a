import sys
from pathlib import Path

# Test helpers (launch.py) live next to the tests.
sys.path.insert(0, str(Path(__file__).parent))
