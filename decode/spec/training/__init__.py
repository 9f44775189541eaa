"""Training-side (dense, plain torch) EAGLE heads: the offline trainers (bench/spec_training) and the
online trainer (decode/spec/online) share them."""
