"""Experiment (2 GPUs): can a kernel on cuda:1 read cuda:0 memory of another process mapped through CUDA
IPC? ``PYTHONPATH=src python3 benchmarks/ipc_probe.py plain enable override`` (on an H200 pair ``override``,
opening the handle in the reader's device context, read correctly; compose runs with the owner-context mapping,
with and without peer access enabled, faulted; cpkv.compose.peer opens handles as ``override`` does)."""
import sys
import torch, torch.multiprocessing as mp


def owner(q, done):
    torch.cuda.set_device(0)
    t = torch.arange(4096 * 16, dtype=torch.int32, device="cuda:0").view(torch.uint8).view(16, -1).contiguous()
    from torch.multiprocessing.reductions import reduce_tensor
    q.put(reduce_tensor(t))
    done.get()


def reader(q, done, variant, res):
    torch.cuda.set_device(1)
    from cpkv.kernels.page_gather.triton import page_gather_triton
    func, args = q.get()
    try:
        if variant == "override":
            args = list(args)
            args[6] = 1  # storage_device: open the IPC handle in this rank's own device context
            peer = func(*args)
        else:
            peer = func(*args)
            if variant == "enable":
                torch.empty(1, device=peer.device).copy_(torch.empty(1, device="cuda:1"))
        torch.cuda.synchronize(1)
        out = torch.zeros((16, peer.shape[1]), dtype=torch.uint8, device="cuda:1")
        bases = torch.tensor([peer.data_ptr()], dtype=torch.int64, device="cuda:1")
        idx = torch.arange(16, device="cuda:1", dtype=torch.int32)
        page_gather_triton(out, bases, idx, torch.zeros(16, dtype=torch.int32, device="cuda:1"), idx.flip(0))
        torch.cuda.synchronize(1)
        want = torch.arange(4096 * 16, dtype=torch.int32).view(torch.uint8).view(16, -1).flip(0)
        res.put((variant, str(peer.device), bool(torch.equal(out.cpu(), want))))
    except Exception as e:  # noqa
        res.put((variant, "error", repr(e)[:300]))
    done.put(1)


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    import inspect
    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    print(inspect.signature(rebuild_cuda_tensor))
    for variant in sys.argv[1:]:
        q, done, res = ctx.Queue(), ctx.Queue(), ctx.Queue()
        a = ctx.Process(target=owner, args=(q, done)); a.start()
        b = ctx.Process(target=reader, args=(q, done, variant, res)); b.start()
        print(res.get(timeout=120), flush=True)
        b.join(60); a.join(60)
