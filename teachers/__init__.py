"""Teachers: resolving teacher references and scoring the student's tokens with them."""
from teachers.scoring import HFTeacher, VLLMTeacher, make_teacher

__all__ = ["HFTeacher", "VLLMTeacher", "make_teacher"]
