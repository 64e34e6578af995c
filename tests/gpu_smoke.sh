#!/bin/bash
# GPU smoke check for the `device` tool (one H200, ~5 min, run from the repo root:
#   bash tests/gpu_smoke.sh  with timeout_s=480; the log lands in $OUT/log).
# Not yet run on a GPU.
# Parts: 1) Triton kernel tests compiled on CUDA; 2) default tiles at real shapes vs the
# torch reference, last case probes the int32-stride overflow; 3) engine on CUDA vs HF fp32
# greedy (tiny Llama/Qwen2); 4) NCCL transfer between two processes on ONE GPU via distinct
# NCCL_HOSTID (sockets over lo; unconfirmed trick: two ranks on one GPU are otherwise refused).
# Baton GPU smoke, one H200, ~5 min. No network there: the image's python3 (torch 2.11+cu130, triton 3.6), no pip.
set -uo pipefail; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 BATON_TEST_GPU=1; L=$OUT/log
py(){ timeout "$1" python3 - 2>&1 | tee -a $L; echo "== exit ${PIPESTATUS[0]}" | tee -a $L; }
python3 -c "import torch,triton,transformers as t;print(torch.__version__,triton.__version__,t.__version__,torch.cuda.get_device_name())" 2>&1 | tee $L
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_triton_attention.py 2>&1 | tee -a $L  # 1) kernel tests, compiled
py 240 <<'EOF'  # 2) default 64/64 tiles, real shapes, num_seqs==1 and %16, bf16 vs fp32 ref; last case: int32 stride overflow (16 GiB/layer)
import torch; from engine.attention import build_metadata as B; from engine.attention.kv_layout import allocate_kv_cache as A, head_major
from engine.attention.torch_backend import TorchAttentionBackend as T; from engine.attention.triton_backend import TritonAttentionBackend as R
g=torch.Generator().manual_seed(0); d=torch.device("cuda"); bf=torch.bfloat16
for H,K,D,bs,ql,sl,nb in [(32,8,128,16,[1024,300,1,1,77],[1024,2348,4000,17,600],700),(9,3,64,16,[1],[3001],200),(9,3,64,16,[513],[513],40),
                          (14,2,64,32,[1]*32,[i*97+1 for i in range(32)],1700),(8,4,128,16,[1,1],[40,33],1<<19)]:
  ids=torch.randperm(nb,generator=g).tolist(); cut=[0]; [cut.append(cut[-1]-(-s//bs)) for s in sl]; tabs=[ids[a:b] for a,b in zip(cut,cut[1:])]
  m=B(ql,sl,tabs,bs,d); r=lambda h: torch.randn(sum(ql),h,D,generator=g).to(d,bf); q,k,v=r(H),r(K),r(K); c=A(nb,bs,K,D,bf,d)
  _=c.copy_(torch.randn(c.shape,generator=g)) if nb<1e5 else 0; c2=c.float(); w=lambda x: head_major(x).flatten(2,3)[:,:,m.slot_mapping]
  ref=T().forward(q.float(),k.float(),v.float(),c2,m,D**-.5); o=R().forward(q,k,v,c,m,D**-.5); torch.cuda.synchronize()
  print(H,K,D,bs,len(ql),nb,"maxerr %.4f"%(o.float()-ref).abs().max().item(),"cache_ok",torch.equal(w(c).float(),w(c2)))
EOF
py 240 <<'EOF'  # 3) engine on CUDA vs HF fp32 greedy: fp32 triton/torch must be 6/6; bf16 reported; seeded sampling reproducible
import torch,tempfile,pathlib; from benchmarks.checkpoints import make_checkpoint; from tests.engine.test_engine_vs_hf import hf_greedy,random_prompts
from engine import LLM, SamplingParams as SP; from transformers import AutoModelForCausalLM as M
G=SP(max_tokens=10,temperature=0.0,ignore_eos=True); P=random_prompts([5,17,33,2,70,300]); S=SP(max_tokens=12,temperature=0.8,top_p=0.9,seed=7)
for kind in ("llama","qwen2"):
  p=str(make_checkpoint(pathlib.Path(tempfile.mkdtemp()),kind)); hf=M.from_pretrained(p,dtype=torch.float32).eval(); want=[hf_greedy(hf,x,10) for x in P]
  for opt in (dict(dtype="float32",attention_backend="triton"),dict(dtype="float32",attention_backend="torch"),dict(dtype="bfloat16")):
    llm=LLM(p,device="cuda",skip_tokenizer_init=True,block_size=16,num_kv_blocks=256,chunk_size=64,max_num_batched_tokens=128,**opt)
    got=[o.token_ids for o in llm.generate(P,G)]; llm.engine.check_integrity(); print(kind,opt,"==HF:",sum(a==b for a,b in zip(got,want)),"/",len(P))
    a,b=([o.token_ids for o in LLM(p,device="cuda",skip_tokenizer_init=True,**opt).generate(P[:2],S)] for _ in "ab"); print("  seeded reproducible:",a==b)
EOF
py 200 <<'EOF'  # 4) NCCL transfer, 2 processes, ONE GPU: distinct NCCL_HOSTID skips the duplicate-GPU check (NET/Socket over lo)
import os,torch; os.environ.update(NCCL_SOCKET_IFNAME="lo",NCCL_IB_DISABLE="1",NCCL_DEBUG="WARN")
from tests.kvtransfer.peer import SenderProcess,make_cache,make_descriptor,LAYERS; from kvtransfer import GroupRegistry,KVTransfer
for hm,src,dst in ((False,[21,3,14,8,0],[19,2,11,5,7]),(True,[4,5,6,7],[8,9,10,11])):  # packed mode, then zero-copy runs mode
  os.environ["NCCL_HOSTID"]="baton-p"; p=SenderProcess(seed=12,num_blocks=24,timeout=30.0,message_bytes=4096,device="cuda:0",head_major=hm); p.wait_ready(120)
  os.environ["NCCL_HOSTID"]="baton-d"; reg=GroupRegistry("cuda:0",timeout=30.0); reg.join("prefill-0",p.host("decode-0"))
  kv=make_cache(20,99,"bfloat16",device="cuda:0",head_major=hm); before=[t.cpu() for t in kv]; mv=dict(zip(dst,src))
  p.start_send("decode-0",make_descriptor(f"r{hm}",src=src,dst=dst,layers=(1,4),dtype="bfloat16"),timeout=30.0)
  got,st=KVTransfer(reg).recv("prefill-0",kv,wait=60.0,timeout=30.0); print("sender:",p.result(60)); exp=p.cache("bfloat16")
  ok=all(torch.equal(kv[l][:,b].cpu(),exp[l][:,mv[b]] if 1<=l<4 and b in mv else before[l][:,b]) for l in range(LAYERS) for b in range(20))
  print(reg.backend,"head_major",hm,st.num_messages,"msgs, exact:",ok); reg.close(); p.close()
EOF
