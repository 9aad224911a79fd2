# Sourced: L4_SHARE, the share of this machine's GPU 0 that holds what the reference gives each engine on its
# L4 (gpu_memory_utilization 0.90 of 24 GB), so engines here get an L4's memory whatever the card.
L4_SHARE=$(python3 -c "import torch; print(round(0.90 * 24e9 / torch.cuda.get_device_properties(0).total_memory, 3))")
