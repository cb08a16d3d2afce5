"""Online learning from served traffic (issue #51): what the inference servers record of the chat completions they
serve and of the feedback their users give (traffic_log.py), and what a firing makes of it."""
