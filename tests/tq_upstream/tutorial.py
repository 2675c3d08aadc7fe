"""Run one TransferQueue tutorial script with rlferry's shim installed as `transfer_queue`."""

import runpy
import sys

import rlferry.compat.transferqueue as shim

shim.install()
path = sys.argv[1]
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
