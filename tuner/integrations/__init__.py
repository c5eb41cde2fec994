"""Serving drop-ins: the FA3 call, the FlashInfer wrappers and decode_attention, each running its calls with the tuning DB's configs."""
