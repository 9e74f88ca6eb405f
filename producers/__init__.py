"""Event sources: the torch.distributed hook and node daemon, the Kineto replayer, the simulator."""
