import io, contextlib, re
from glm_lightning.cli import main
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    try: main(["fit", "--config", "configs/pretrain.yaml", "--help"])
    except SystemExit: pass
text = buf.getvalue()
blocks = re.split(r"\n  (?=--)", text)
for b in blocks:
    if b.startswith(("--model.", "--data.")):
        head, _, rest = b.partition("\n")
        desc = rest.split("(type:")[0].strip() if "(type:" in rest else rest.strip()
        if not desc: print("NO DESC:", head)
print(text[text.find("--model.init_args.model_overrides"):][:1500])
