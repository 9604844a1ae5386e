"""Everything about a run that is not a DAPO step: its directory and lock (:mod:`.directory`, :mod:`.lock`), the
configs it ran with and what a resume may change (:mod:`.config_record`), how it stops on a signal
(:mod:`.stop_signals`), whether its steps changed the policy (:mod:`.progress`), what a command reads, checked before
anything expensive (:mod:`.input_checks`), and the HF folder its policy starts from (:mod:`.model_source`).
"""
