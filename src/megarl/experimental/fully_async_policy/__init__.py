"""verl.experimental.fully_async_policy under megarl's name."""
