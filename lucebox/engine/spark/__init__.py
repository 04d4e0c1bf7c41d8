"""Spark: MoE expert offload. The experts a model's traffic uses live on the device, the rest in host memory.

- traffic.py    prompt files (logged chat requests, SWE-bench issues, agent prompts) -> conversations;
- profile.py    the routing counter hooked into MoE.forward, the placement profile JSON and its checks;
- calibrate.py  `python -m lucebox spark calibrate`: replay traffic, count, write the profile;
- placement.py  the hot set for a byte budget (calibrated or uniform) and its cold-hit rate;
- offload.py    MoE.offload: device slots, the per-layer LRU ring, host store, copies, the CPU rule;
- engine.py     SparkConfig and an LLMEngine over a model whose experts are placed;
- simulate.py   `--router-skew zipf:S`, the popularity simulation for random-weight models.

    engine, spark = spark_engine(path, EngineConfig(...), SparkConfig(profile=p, budget="60%", ring=8))
    spark.props()   # placement, cold-hit rate, copies/s, CPU-expert time (/props `spark`)
"""
