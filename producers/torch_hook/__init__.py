"""The torch.distributed hook: op log, wrappers, group naming, and the socket to the node agent."""
