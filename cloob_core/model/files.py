"""The files of an exported model folder, named without importing torch: promotion handles model folders
without loading them. The first two are the names open_clip's ``local-dir:`` and ``hf-hub:`` loaders look for."""

CONFIG_FILE = "open_clip_config.json"  # {"model_cfg": ..., "preprocess_cfg": ...}
STATE_FILE = "open_clip_model.safetensors"  # the weights of a plain open_clip.CLIP, no pickle
EARLIER_STATE_FILE = "open_clip_model.pt"  # the weights in the earlier layout (a torch state dict), still read
INFO_FILE = "model_info.json"  # what open_clip does not keep: architecture name, inv_tau, how it was trained
LOCAL_DIR = "local-dir:"  # open_clip's prefix for a model folder
