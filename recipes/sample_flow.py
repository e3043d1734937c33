"""Sample images from a saved FlowMatchPipeline: a grid PNG plus one PNG per image.

    python recipes/sample_flow.py runs/flow --num_images 64 --scheduler heun --num_inference_steps 20 \
        --class_labels 0,1,2 --guidance_scale 2 --seed 0 --output_dir runs/flow/samples_cli
"""

import sys

from hf_cgpu.flow.sample import main

if __name__ == "__main__":
    sys.exit(main())
