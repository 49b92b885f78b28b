import torch, time, traceback, sys
sys.path.insert(0, ".")
from mstar_core.testing.timing import kernel_ms
from mstar_core.sampling import Sampler, SamplingParams, FILTERS
dev = "cuda"
for V in (49152, 128256):
    x = torch.randn(64, V, device=dev, dtype=torch.bfloat16) * 3
    f = x.float()
    res = {}
    res["float"] = kernel_ms(lambda: x.float())
    res["argmax"] = kernel_ms(lambda: f.argmax(-1))
    res["softmax"] = kernel_ms(lambda: torch.softmax(f, -1))
    res["cumsum"] = kernel_ms(lambda: f.cumsum(-1))
    c = f.softmax(-1).cumsum(-1); u = torch.rand(64, 1, device=dev)
    res["searchsorted"] = kernel_ms(lambda: torch.searchsorted(c, u))
    res["sort_f32"] = kernel_ms(lambda: f.sort(-1, descending=True))
    res["sort_bf16"] = kernel_ms(lambda: x.sort(-1, descending=True))
    for k in (64, 256, 1024):
        res[f"topk{k}"] = kernel_ms(lambda k=k: f.topk(k, -1))
        res[f"topk{k}_bf16"] = kernel_ms(lambda k=k: x.topk(k, -1))
    res["hash_gumbel_eager"] = kernel_ms(lambda: (torch.arange(V, device=dev)[None] ^ torch.arange(64, device=dev)[:, None]) * 3 & 0xFFFF)
    print(V, {k: round(v * 1e3, 1) for k, v in res.items()}, "us", flush=True)
    for filters in ((), ("top_k", "top_p"), FILTERS):
        s = Sampler(dev, 64, V, filters)
        s.set_rows([s.admit(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1) if filters else SamplingParams(temperature=0.8), i, [1, 2, 3]) for i in range(64)])
        pos = torch.arange(64, device=dev)
        try:
            eager = kernel_ms(lambda: s.sample(x, pos))
        except Exception as e:
            eager = repr(e)[:200]
        try:
            fn = torch.compile(s.sample, fullgraph=True, dynamic=False)
            fn(x, pos)
            comp = kernel_ms(lambda: fn(x, pos))
        except Exception as e:
            traceback.print_exc()
            comp = repr(e)[:300]
        print(V, filters, "eager_ms", eager, "compiled_ms", comp, flush=True)
