"""The files of an exported model folder, named without importing torch: promotion handles model folders
without loading them."""

STATE_FILE = "open_clip_model.pt"  # the state dict, loadable by plain open_clip
INFO_FILE = "model_info.json"  # architecture, inv_tau, the config it was trained with
