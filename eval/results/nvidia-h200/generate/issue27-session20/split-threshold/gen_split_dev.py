import sys
sys.path.insert(0, '.')
from hf_tiled_attention import launch
launch.EAGER_SPLIT_MIN_BYTES = int(sys.argv[1])
from eval import generate_throughput
generate_throughput.main(sys.argv[2:])
