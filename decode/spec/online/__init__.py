"""Online adaptation of the EAGLE head (`--spec-online`): the head learns from served traffic.

Reading order: messages.py (what crosses between the decode workers and the trainer), capture.py
(the decode worker's bounded per-tenant buffer of served tokens and features), heads.py (the
decode worker's per-tenant head versions, staged then activated between steps), policy.py (when a
candidate is promoted and when a live head is rolled back), objective.py (what the head trains
with: the training-time test, also the offline trainers'), trainer.py (fine-tuning and the
held-out score), store.py (promoted heads on disk, and what a restarted trainer resumes),
service.py (the low-priority trainer actor that closes the loop).
"""
