"""The privacy filter: what leaves the machine (hosted training, a remote judge) is masked first.

`detect` finds secrets and personal data in text (`PrivacyFilter`); `tokens` applies it to training
datums at the token level; `guard` decides where it is on and counts what it filtered.
See docs/privacy.md.
"""
