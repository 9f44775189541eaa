"""The draft heads as plain-torch modules (dense, differentiable): their configs, weights' load and
save, and the dense greedy drafting the runtime is checked against.

Reading order: eagle.py (the EAGLE head, the Llama layer pieces the others reuse, the target's
frozen parts, `FeatureHook`), eagle3.py (the EAGLE-3-style head: fused depths, its own draft
vocabulary), block.py (the DFlash-style block drafter, which serving runs as is:
decode/spec/block.py). The serving engine runs the EAGLE heads its own way
(decode/spec/eagle_head.py). Training lives elsewhere: what online adaptation trains with in
decode/spec/online/ (objective.py), the offline trainers in bench/spec_training/ (outside the
package).
"""
