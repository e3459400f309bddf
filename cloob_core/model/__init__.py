"""The dual encoder (open_clip architectures, our configs in configs/) and its open_clip-loadable export."""
