import subprocess
import sys

subprocess.run([sys.executable, "-m", "pip", "install", "zstandard"], check=True)
