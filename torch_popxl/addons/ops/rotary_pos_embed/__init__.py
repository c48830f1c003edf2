"""``addons.ops.rotary_pos_embed``."""

from .rotary_pos_embed import rotary_pos_embed, trig_table_constants, trig_tables

__all__ = ["rotary_pos_embed", "trig_table_constants", "trig_tables"]
