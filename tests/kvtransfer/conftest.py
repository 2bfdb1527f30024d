import os
import sys

# kvx_peer.py is a helper beside the tests; spawned peer processes import it by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
