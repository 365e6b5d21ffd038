"""verl.experimental.one_step_off_policy under megarl's name."""
