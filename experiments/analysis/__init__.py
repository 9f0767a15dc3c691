"""Analysis the experiments share and the library never imports: trace replay of
replacement policies (``cache_sim``), selection tracing on the real model
(``tracing``) and the host-link IO model (``io_model``)."""
