"""What a person runs (`ocpc launch`, `doctor`, `status`, `top`, `stats`, the demo): each command's
work, which cli.py only parses for."""
