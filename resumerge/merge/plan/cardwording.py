"""The words a model card is written in (:class:`CardWording`), apart from the card itself: the plan carries a kind
of run's wording (a tokenizer transplant's), and :mod:`resumerge.merge.plan.modelcard` renders it; neither imports the
other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CardWording:
    """The words a kind of run's card is written in, where they are not a merge's: its title (a merge's name comes
    from its config), the paragraph under it, the method's heading, sections of its own after the models (heading,
    lines), each model's role by key (a merge's says "base model"), and how its recorded text is introduced
    (heading, sentence, fence language). Notes that a section already shows are not repeated under Notes."""

    title: str = "Merged model"
    lead: str = ("This is a merge of pre-trained language models, made with resumerge from a "
                 "[mergekit](https://github.com/arcee-ai/mergekit) configuration.")
    method_heading: str = "Merge method"
    sections: tuple[tuple[str, tuple[str, ...]], ...] = ()
    roles: tuple[tuple[str, str], ...] = ()
    config_heading: str = "Configuration"
    config_intro: str = "The following YAML configuration was used to produce this model:"
    config_language: str = "yaml"
    tags: tuple[str, ...] = ()


MERGE_WORDING = CardWording()
