"""Dev (CPU, perf-notes step 48): the sm_90 dK/dV cubin with kv-persistent.patch applied, as
`python kv_persistent_sass.py D CAUSAL BLOCKS_PER_SM` from the repository root (BLOCKS_PER_SM 0:
the grid of one block per key tile). Prints registers, stack, shared memory and per step loop
(instructions, MMAs, spill reloads); D=64 in the fast mode (dq_add), larger D deterministic."""
import sys, dataclasses, torch
sys.path.insert(0, '.')
from eval import inspect_cubin as ic
from hf_tiled_attention.backward_launch import backward_plan, export_backward_cubins
from hf_tiled_attention.schedule import backward_schedule
d, causal, pers = int(sys.argv[1]), sys.argv[2] == '1', int(sys.argv[3])
hkv = 8 if d == 128 else 32
q = torch.empty(1, 32, 1024, d, dtype=torch.bfloat16, device="meta")
k = torch.empty(1, hkv, 1024, d, dtype=torch.bfloat16, device="meta")
s = dataclasses.replace(backward_schedule(d), kv_persistent=pers)
plan = backward_plan(torch.bfloat16, 32 // hkv, d, None, causal, d ** -0.5, False, None, None, s, False, d > 64)
cubins = export_backward_cubins(plan, q, k, arch="sm_90")
info = ic.report(cubins[1])
print(d, causal, pers, {x: info[x] for x in ('reg', 'stack', 'shared', 'instructions')}, [ (l['instructions'], l['mma'], l['LDL']) for l in info['mma_loops']])
