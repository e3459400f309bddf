"""``cloob train``: the paper's recipe as open_clip's training loop runs it, resumable to the exact step."""
