"""The counting barrier's GPU form (compose): one single-program kernel per round on the rank's stream.

    dispatch   cpkv.compose.barrier.make_barrier (DeviceBarrier on CUDA IPC peer memory with Triton, else the
               host-waited CountingBarrier)
    reference  cpkv.compose.barrier.CountingBarrier: the same protocol waited on the host
    kernel     triton.py
"""
