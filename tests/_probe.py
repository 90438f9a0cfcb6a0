import tests.sharding_ranks as sr
def probe(run):
    from megatron.core.utils import unwrap_model
    flavor, chunk, opt = sr._build(run, True)
    u = unwrap_model(chunk)
    out = [type(chunk).__name__, type(chunk.module).__name__, type(u).__name__, [n for n, _ in chunk.named_parameters()][:2], [n for n, _ in u.named_parameters()][:2]]
    sr.finish()
    return out
