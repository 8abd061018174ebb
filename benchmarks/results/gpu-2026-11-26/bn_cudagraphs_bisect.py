"""Which part of the BatchNorm schedule goes wrong under cudagraphs=True? (device debugging)"""
import copy, os, sys, tempfile
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
sys.path.insert(0, os.getcwd())
import distcompile

def model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 8))

def schedule(m, opt, *, sizes, no_sync, eval_between):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(n, 32, generator=g).cuda(), torch.randn(n, 8, generator=g).cuda()) for n in sizes]
    losses, evals = [], []
    def step(x, y):
        loss = torch.nn.functional.mse_loss(m(x), y); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    for x, y in data[:2]:
        step(x, y)
    if no_sync:
        with m.no_sync():
            torch.nn.functional.mse_loss(m(data[2][0]), data[2][1]).backward()
    else:
        step(*data[2])
    step(*data[3])
    if eval_between:
        m.eval()
        with torch.no_grad():
            evals.append(m(data[0][0]).clone())
        m.train()
    for x, y in data[4:]:
        step(x, y)
    return losses, evals

torch.cuda.set_device(0)
d = tempfile.mkdtemp()
dist.init_process_group("nccl", init_method=f"file://{d}/pg", rank=0, world_size=1)
cases = {
    "full": dict(sizes=(16,) * 4 + (24,) * 2, no_sync=True, eval_between=True),
    "no eval": dict(sizes=(16,) * 4 + (24,) * 2, no_sync=True, eval_between=False),
    "one size": dict(sizes=(16,) * 6, no_sync=True, eval_between=True),
    "no no_sync": dict(sizes=(16,) * 4 + (24,) * 2, no_sync=False, eval_between=True),
    "plain steps": dict(sizes=(16,) * 6, no_sync=False, eval_between=False),
}
for name, kw in cases.items():
    for how in ("dc_cg", "dc", "torch_ro"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        base = model().cuda()
        ref = DDP(copy.deepcopy(base), device_ids=[0])
        if how == "torch_ro":
            if kw["no_sync"]:
                continue
            ours = torch.compile(copy.deepcopy(base), mode="reduce-overhead")
        else:
            ours = distcompile.wrap(DDP(copy.deepcopy(base), device_ids=[0]), backend="inductor", cudagraphs=how == "dc_cg")
        r = schedule(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), **kw)
        o = schedule(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), **kw)
        dl = [round(abs(a - b), 5) for a, b in zip(r[0], o[0])]
        de = [float((a - b).abs().max()) for a, b in zip(r[1], o[1])]
        print(f"{name:12s} {how:9s} loss diffs {dl} eval diffs {de}", flush=True)
dist.destroy_process_group()
