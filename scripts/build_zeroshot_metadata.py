"""Regenerate cloob_core/zeroshot_metadata/*.json: class names and prompt templates of the CLOOB paper's
zero-shot data sets, as facts carried over from their published sources.

Sources: CLIP_benchmark's `en_classnames.json` and `en_zeroshot_classification_templates.json` (MIT licence;
the wheel is fetched with `pip download`), open_clip's ImageNet class names and OpenAI templates (MIT), and the
CIFAR-10 / STL-10 class lists of their data sets. Each file records its source. Run from the repository root:

    .venv/bin/python scripts/build_zeroshot_metadata.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "cloob_core" / "zeroshot_metadata"
# paper name -> CLIP_benchmark key (None: not in CLIP_benchmark)
PAPER_SETS = {
    "birdsnap": None, "country211": "country211", "flowers102": "flowers", "gtsrb": "gtsrb", "ucf101": None,
    "stanford_cars": "cars", "imagenet": "imagenet1k", "imagenet_v2": "imagenet1k", "caltech101": "caltech101",
    "cifar10": "cifar10", "cifar100": "cifar100", "dtd": "dtd", "eurosat": "eurosat", "fer2013": "fer2013",
    "fgvc_aircraft": "fgvc_aircraft", "food101": "food101", "pets": "pets", "resisc45": "resisc45", "stl10": "stl10",
    "sun397": "sun397",
}
KNOWN_CLASSES = {  # the data sets' own label lists
    "cifar10": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
    "stl10": ["airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck"],
    # CIFAR-100's fine labels, underscores as spaces (as CLIP prompts them)
    "cifar100": [
        "apple", "aquarium fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
        "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee",
        "clock", "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant",
        "flatfish", "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn mower",
        "leopard", "lion", "lizard", "lobster", "man", "maple tree", "motorcycle", "mountain", "mouse", "mushroom",
        "oak tree", "orange", "orchid", "otter", "palm tree", "pear", "pickup truck", "pine tree", "plain", "plate",
        "poppy", "porcupine", "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark",
        "shrew", "skunk", "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower",
        "sweet pepper", "table", "tank", "telephone", "television", "tiger", "tractor", "train", "trout", "tulip",
        "turtle", "wardrobe", "whale", "willow tree", "wolf", "woman", "worm",
    ],
    # DTD's 47 texture categories
    "dtd": [
        "banded", "blotchy", "braided", "bubbly", "bumpy", "chequered", "cobwebbed", "cracked", "crosshatched",
        "crystalline", "dotted", "fibrous", "flecked", "freckled", "frilly", "gauzy", "grid", "grooved", "honeycombed",
        "interlaced", "knitted", "lacelike", "lined", "marbled", "matted", "meshed", "paisley", "perforated", "pitted",
        "pleated", "polka-dotted", "porous", "potholed", "scaly", "smeared", "spiralled", "sprinkled", "stained",
        "stratified", "striped", "studded", "swirly", "veined", "waffled", "woven", "wrinkled", "zigzagged",
    ],
}


def clip_benchmark_json() -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "clip_benchmark==1.6.2",
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            names = json.loads(archive.read("clip_benchmark/datasets/en_classnames.json"))
            templates = json.loads(archive.read("clip_benchmark/datasets/en_zeroshot_classification_templates.json"))
    return names, templates


def main() -> None:
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    names, templates = clip_benchmark_json()
    OUT.mkdir(parents=True, exist_ok=True)
    index = {}
    for dataset, key in PAPER_SETS.items():
        entry: dict = {"dataset": dataset, "sources": []}
        if dataset in ("imagenet", "imagenet_v2"):
            entry["classnames"] = list(IMAGENET_CLASSNAMES)
            entry["templates"] = [t("{c}") for t in OPENAI_IMAGENET_TEMPLATES]
            entry["sources"].append("open_clip zero_shot_metadata (MIT): IMAGENET_CLASSNAMES, "
                                    "OPENAI_IMAGENET_TEMPLATES")
        else:
            if key in names:
                entry["classnames"] = names[key]
                entry["sources"].append("CLIP_benchmark 1.6.2 en_classnames.json (MIT)")
            elif dataset in KNOWN_CLASSES:
                entry["classnames"] = KNOWN_CLASSES[dataset]
                entry["sources"].append(f"{dataset} label list")
            if key in templates:
                entry["templates"] = templates[key]
                entry["sources"].append("CLIP_benchmark 1.6.2 en_zeroshot_classification_templates.json (MIT)")
        index[dataset] = {"classnames": len(entry.get("classnames", [])), "templates": len(entry.get("templates", []))}
        if "classnames" in entry or "templates" in entry:
            (OUT / f"{dataset}.json").write_text(json.dumps(entry, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(index, indent=1))


if __name__ == "__main__":
    main()
