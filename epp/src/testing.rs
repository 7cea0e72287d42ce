//! Helpers for tests and benchmarks: a real tokenizer without a download.

use std::path::Path;

/// Trains a BPE tokenizer (whitespace pre-tokenizer, `vocab_size`
/// entries) on the Markdown files in `docs`, saves it as a
/// `tokenizer.json` at `path`, and returns it loaded from there.
pub fn train_tokenizer(docs: &Path, vocab_size: usize, path: &Path) -> tokenizers::Tokenizer {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    let files: Vec<String> = std::fs::read_dir(docs)
        .expect("the docs folder")
        .filter_map(|e| Some(e.ok()?.path().to_string_lossy().into_owned()))
        .filter(|p| p.ends_with(".md"))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .build()
        .into();
    let mut t = tokenizers::Tokenizer::new(BPE::default());
    t.with_pre_tokenizer(Some(Whitespace {}));
    t.train_from_files(&mut trainer, files)
        .expect("training on the docs");
    t.save(path, false).expect("saving tokenizer.json");
    tokenizers::Tokenizer::from_file(path).expect("the saved tokenizer loads")
}
