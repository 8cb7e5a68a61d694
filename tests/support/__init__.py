"""What the tests share: real processes started and waited for, payloads, stores and jobs."""
