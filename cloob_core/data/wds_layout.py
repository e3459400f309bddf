"""The file names of CLIP_benchmark's ``wds`` layout: written by `cloob data eval-set`, read by `cloob eval`."""

CLASSNAMES_FILE = "classnames.txt"  # one class name per line, in label order
TEMPLATES_FILE = "zeroshot_classification_templates.txt"  # one prompt per line, {c} where the class name goes
SHARD_COUNT_FILE = "nshards.txt"  # in each split's folder: the number of tars 0.tar … (n-1).tar
DATASET_TYPE_FILE = "dataset_type.txt"  # "retrieval" for image-caption sets; absent: classification
