"""Dev: trivial cuTile kernels to time ct.launch's per-argument host cost."""
import cuda.tile as ct


@ct.kernel
def one_array(a):
    t = ct.load(a, index=(0,), shape=(16,))
    ct.store(a, index=(0,), tile=t)


@ct.kernel
def nine_arrays(a, b, c, d, e, f, g, h, i):
    t = ct.load(a, index=(0,), shape=(16,))
    ct.store(a, index=(0,), tile=t)
