"""The statements of the transformers forwards the fused decode step computes, form by form
(each top-level statement of a body, unparsed, whitespace removed: fusion/models/source_forms.py
``body_statements``), and the attributes patch marks a layer's form with. The checks that read
them: fusion/models/decode_checks.py."""

from __future__ import annotations

QKV_NAME = "qkv_proj"  # the fused Q/K/V module of a patched attention

# The forwards the step computes, statement by statement (each top-level statement of the
# body, unparsed, whitespace removed; a tuple: one of these forms): transformers 5.3-5.25's
# Llama, Qwen2, Qwen3, Mistral, Gemma, Qwen2-MoE, Qwen3-MoE and Mixtral decoder layers and attentions.
# A forward with any other or any further statement is not fused (a subclass's extra line would
# otherwise be skipped).
_ATTENTION_CALL = ("hidden_states,_=self.self_attn(hidden_states=hidden_states,attention_mask=attention_mask,"
                   "position_ids=")
_LAYER_BODY = (
    "residual=hidden_states",
    "hidden_states=self.input_layernorm(hidden_states)",
    (_ATTENTION_CALL + "position_ids,cache=cache,use_cache=use_cache,position_embeddings=position_embeddings,**kwargs)",
     _ATTENTION_CALL + "position_ids,past_key_values=past_key_values,use_cache=use_cache,cache_position=cache_position,"
     "position_embeddings=position_embeddings,**kwargs)",
     _ATTENTION_CALL + "position_ids,past_key_values=past_key_values,use_cache=use_cache,"
     "position_embeddings=position_embeddings,**kwargs)",
     # Mixtral's: the same arguments in another order, no use_cache (its attention takes none)
     "hidden_states,_=self.self_attn(hidden_states=hidden_states,position_embeddings=position_embeddings,"
     "attention_mask=attention_mask,position_ids=position_ids,cache=cache,**kwargs)",
     "hidden_states,_=self.self_attn(hidden_states=hidden_states,position_embeddings=position_embeddings,"
     "attention_mask=attention_mask,position_ids=position_ids,past_key_values=past_key_values,**kwargs)"),
    "hidden_states=residual+hidden_states",
    "residual=hidden_states",
    "hidden_states=self.post_attention_layernorm(hidden_states)",
    "hidden_states=self.mlp(hidden_states)",
    "hidden_states=residual+hidden_states",
    "returnhidden_states",
)
# Granite's layer: the same, each sublayer's output times residual_multiplier before the add
_SCALED_ADD = "hidden_states=residual+hidden_states*self.residual_multiplier"
_SCALED_LAYER_BODY = tuple(_SCALED_ADD if s == "hidden_states=residual+hidden_states" else s for s in _LAYER_BODY)
# A post-norm layer's norms, in the order its forward applies them: the input norm, the attention
# output's (before its residual add), the MLP input's, the MLP output's (before its add); None
# where the form has none. Gemma 2's and Gemma 3's names:
POST_NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")
# GLM-4's (0414): the same norms, named after what they follow
GLM4_POST_NORM_NAMES = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")
# OLMo 2's: no input norms (the attention and the MLP read the residual stream as it is)
OUTPUT_NORM_NAMES = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


def _post_norm_layer_body(names: tuple) -> tuple:
    """The post-norm layer's statements over norms of ``names`` (a name None: that norm absent)."""
    def norm(name):
        return () if name is None else (f"hidden_states=self.{name}(hidden_states)",)

    return ("residual=hidden_states", *norm(names[0]), _LAYER_BODY[2], *norm(names[1]),
            "hidden_states=residual+hidden_states", "residual=hidden_states", *norm(names[2]),
            "hidden_states=self.mlp(hidden_states)", *norm(names[3]), "hidden_states=residual+hidden_states",
            "returnhidden_states")


# Each post-norm form's names by its statements: each sublayer's output normalised before its
# residual add, the MLP's input normalised as the attention's (where the form has input norms)
POST_NORM_FORMS = {names: _post_norm_layer_body(names) for names in (POST_NORM_NAMES, GLM4_POST_NORM_NAMES,
                                                                     OUTPUT_NORM_NAMES)}
# Instance attribute set when a layer is patched: the names of its norms (POST_NORM_FORMS).
POST_NORMS = "_hybridgemm_post_norms"
# Phi-3's layer: the same, each sublayer's output through a dropout module before the add
# (the identity unless the layer trains with p > 0: residual_dropouts, checked per call)
RESIDUAL_DROPOUTS = ("resid_attn_dropout", "resid_mlp_dropout")
# (and its attention call names the unused weights self_attn_weights)
_DROPOUT_ADDS = iter(f"hidden_states=residual+self.{n}(hidden_states)" for n in RESIDUAL_DROPOUTS)
_DROPOUT_LAYER_BODY = tuple(
    next(_DROPOUT_ADDS) if s == "hidden_states=residual+hidden_states"
    else tuple(c.replace("hidden_states,_=", "hidden_states,self_attn_weights=", 1) for c in s) if isinstance(s, tuple)
    else s for s in _LAYER_BODY)
# StableLM's layer: one input LayerNorm; its forward adds the attention and the MLP of the same
# normalised input in parallel, or in sequence with the MLP's input normalised by
# post_attention_layernorm, as the instance's use_parallel_residual says; the MLP's output
# through a dropout module (the identity unless the layer trains with p > 0)
_CHOSEN_RESIDUAL_CALL = ("self_attn_output,_=self.self_attn(hidden_states=hidden_states,attention_mask=attention_mask,"
                         "position_ids=position_ids,{},use_cache=use_cache,position_embeddings=position_embeddings)")
_CHOSEN_RESIDUAL_LAYER_BODY = (
    *_LAYER_BODY[:2],
    tuple(_CHOSEN_RESIDUAL_CALL.format(c) for c in ("cache=cache", "past_key_values=past_key_values")),
    "ifself.use_parallel_residual:mlp_output=self.mlp(hidden_states)mlp_output=self.dropout(mlp_output)"
    "hidden_states=residual+self_attn_output+mlp_outputelse:residual=residual+self_attn_output"
    "mlp_output=self.mlp(self.post_attention_layernorm(residual))mlp_output=self.dropout(mlp_output)"
    "hidden_states=residual+mlp_output",
    "returnhidden_states",
)
# Cohere's layer: one input norm, the attention and the MLP of the normalised input added to
# the residual in parallel (left to right: residual + attention, then + MLP)
_PARALLEL_LAYER_BODY = (
    *_LAYER_BODY[:2],
    (*("hidden_states_attention,_=self.self_attn(hidden_states=hidden_states,attention_mask=attention_mask,"
       f"position_ids=position_ids,{c},use_cache=use_cache,position_embeddings=position_embeddings,**kwargs)"
       for c in ("cache=cache", "past_key_values=past_key_values")),
     # Cohere 2's: position_ids (not a parameter of its forward) passed in its **kwargs
     *("hidden_states_attention,_=self.self_attn(hidden_states=hidden_states,position_embeddings=position_embeddings,"
       f"attention_mask=attention_mask,{c},use_cache=use_cache,**kwargs)"
       for c in ("cache=cache", "past_key_values=past_key_values"))),
    "hidden_states_mlp=self.mlp(hidden_states)",
    "hidden_states=residual+hidden_states_attention+hidden_states_mlp",
    "returnhidden_states",
)
# Instance attribute set when a layer of one of the two forms above is patched: the step calls
# its norms as the modules they are, and takes its residual form from this value: "parallel"
# (Cohere's) or "chosen" (StableLM's: as the instance's use_parallel_residual says); GPT-NeoX's
# and Falcon's layers "gpt_neox" and "falcon" (their step: fusion/models/layernorm_layers.py).
NORMS_AS_MODULES = "_hybridgemm_norms_as_modules"
LAYER_NORM_NAMES = ("input_layernorm", "post_attention_layernorm")  # a pre-norm layer's two norms
MLP_DROPOUT = "dropout"  # StableLM's dropout module
_PLAIN_Q = "query_states=self.q_proj(hidden_states).view(hidden_shape).transpose(1,2)"
_PLAIN_K = "key_states=self.k_proj(hidden_states).view(hidden_shape).transpose(1,2)"
_NORMED_Q = "query_states=self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1,2)"
_NORMED_K = "key_states=self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1,2)"
# cache.update's calling convention, by the form of the statement that calls it
UPDATE_FORMS = {
    "ifcacheisnotNone:key_states,value_states=cache.update(key_states,value_states,self.layer_idx,kwargs=kwargs)":
        "kwargs",
    "ifpast_key_valuesisnotNone:cache_kwargs={'sin':sin,'cos':cos,'cache_position':cache_position}key_states,"
    "value_states=past_key_values.update(key_states,value_states,self.layer_idx,cache_kwargs)": "cache_kwargs",
    "ifpast_key_valuesisnotNone:key_states,value_states=past_key_values.update(key_states,value_states,self.layer_idx)":
        "none",
}
_INTERFACE_CALL = ("attn_output,attn_weights=attention_interface(self,query_states,key_states,value_states,"
                   "attention_mask,dropout=0.0ifnotself.trainingelseself.attention_dropout,scaling=self.scaling,")
# Gemma 2's call: its dropout written the other way round, and a softcap (attn_logit_softcapping)
_SOFTCAP_CALL = ("attn_output,attn_weights=attention_interface(self,query_states,key_states,value_states,"
                 "attention_mask,dropout=self.attention_dropoutifself.trainingelse0.0,scaling=self.scaling,"
                 "sliding_window=self.sliding_window,softcap=self.attn_logit_softcapping,**kwargs)")
# transformers' eager attention functions, statement by statement, that the decode attention
# kernel computes (its logits in fp32): Llama's, and Gemma 2's with its softcap and default scale
_EAGER_BODY = (
    "key_states=repeat_kv(key,module.num_key_value_groups)",
    "value_states=repeat_kv(value,module.num_key_value_groups)",
    "attn_weights=torch.matmul(query,key_states.transpose(2,3))*scaling",
    "ifattention_maskisnotNone:attn_weights=attn_weights+attention_mask",
    "attn_weights=nn.functional.softmax(attn_weights,dim=-1,dtype=torch.float32).to(query.dtype)",
    "attn_weights=nn.functional.dropout(attn_weights,p=dropout,training=module.training)",
    "attn_output=torch.matmul(attn_weights,value_states)",
    "attn_output=attn_output.transpose(1,2).contiguous()",
    "return(attn_output,attn_weights)",
)
# GPT-NeoX's: Llama's without GQA (as many kv heads as heads)
_NO_GQA_EAGER_BODY = (
    "attn_weights=torch.matmul(query,key.transpose(2,3))*scaling", *_EAGER_BODY[3:6],
    "attn_output=torch.matmul(attn_weights,value)", *_EAGER_BODY[7:],
)
_SOFTCAP_EAGER_BODY = (
    "ifscalingisNone:scaling=module.head_dim**(-0.5)", *_EAGER_BODY[:3],
    "ifsoftcapisnotNone:attn_weights=attn_weights/softcapattn_weights=torch.tanh(attn_weights)"
    "attn_weights=attn_weights*softcap",
    *_EAGER_BODY[3:],
)
# Gemma 3's call: Gemma 2's without the softcap
_GEMMA_CALL = _SOFTCAP_CALL.replace("softcap=self.attn_logit_softcapping,", "")
# the sliding window the attention function is given, by the form of the call
WINDOW_FORMS = {
    _GEMMA_CALL: "module",
    _INTERFACE_CALL + "**kwargs)": None,
    _INTERFACE_CALL + "sliding_window=getattr(self.config,'sliding_window',None),**kwargs)": "config",
    _INTERFACE_CALL + "sliding_window=self.sliding_window,**kwargs)": "module",
    # Ministral 3's: position_ids, a parameter of its forward, passed on by name (the step passes the
    # call's position_ids on as the other forms' **kwargs hold it)
    _INTERFACE_CALL + "sliding_window=getattr(self.config,'sliding_window',None),position_ids=position_ids,**kwargs)":
        "config",
    _SOFTCAP_CALL: "module",
    # EXAONE 4's: the module's window where its layer slides (is_sliding), else none
    _INTERFACE_CALL + "sliding_window=self.sliding_windowifself.is_slidingelseNone,**kwargs)": "flagged",
}
_ATTENTION_BODY = (
    "input_shape=hidden_states.shape[:-1]",
    "hidden_shape=(*input_shape,-1,self.head_dim)",
    (_PLAIN_Q, _NORMED_Q),
    (_PLAIN_K, _NORMED_K),
    "value_states=self.v_proj(hidden_states).view(hidden_shape).transpose(1,2)",
    "cos,sin=position_embeddings",
    "query_states,key_states=apply_rotary_pos_emb(query_states,key_states,cos,sin)",
    tuple(UPDATE_FORMS),
    "attention_interface:Callable=ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,"
    "eager_attention_forward)",
    tuple(WINDOW_FORMS),
    "attn_output=attn_output.reshape(*input_shape,-1).contiguous()",
    "attn_output=self.o_proj(attn_output)",
    "return(attn_output,attn_weights)",
)
# Phi-3's attention: Q/K/V one linear in the checkpoint (qkv_proj), its columns [q | k | v]
# sliced, then the same as the above from the rotary on
_QUERY_COLUMNS = "query_pos=self.config.num_attention_heads*self.head_dim"
_PREFUSED_ATTENTION_BODY = (
    *_ATTENTION_BODY[:2],
    f"qkv=self.{QKV_NAME}(hidden_states)",
    _QUERY_COLUMNS,
    "query_states=qkv[...,:query_pos]",
    "key_states=qkv[...,query_pos:query_pos+self.num_key_value_heads*self.head_dim]",
    "value_states=qkv[...,query_pos+self.num_key_value_heads*self.head_dim:]",
    "query_states=query_states.view(hidden_shape).transpose(1,2)",
    "key_states=key_states.view(hidden_shape).transpose(1,2)",
    "value_states=value_states.view(hidden_shape).transpose(1,2)",
    *_ATTENTION_BODY[5:],
)
# StableLM's attention: the three projections viewed per head, per-head q/k LayerNorms where the
# instance's qk_layernorm says so, the rotary over the first rotary_ndims columns of each head
# (the rest passed), position_ids given to the attention function, no further keyword arguments
_PARTIAL_ROTARY_ATTENTION_BODY = (
    "bsz,q_len,_=hidden_states.size()",
    "query_states=self.q_proj(hidden_states)",
    "key_states=self.k_proj(hidden_states)",
    "value_states=self.v_proj(hidden_states)",
    "query_states=query_states.view(bsz,q_len,self.num_heads,self.head_dim).transpose(1,2)",
    "key_states=key_states.view(bsz,q_len,self.num_key_value_heads,self.head_dim).transpose(1,2)",
    "value_states=value_states.view(bsz,q_len,self.num_key_value_heads,self.head_dim).transpose(1,2)",
    "ifself.qk_layernorm:query_states=self.q_layernorm(query_states)key_states=self.k_layernorm(key_states)",
    "cos,sin=position_embeddings",
    "query_rot,query_pass=(query_states[...,:self.rotary_ndims],query_states[...,self.rotary_ndims:])",
    "key_rot,key_pass=(key_states[...,:self.rotary_ndims],key_states[...,self.rotary_ndims:])",
    "query_rot,key_rot=apply_rotary_pos_emb(query_rot,key_rot,cos,sin)",
    "query_states=torch.cat((query_rot,query_pass),dim=-1)",
    "key_states=torch.cat((key_rot,key_pass),dim=-1)",
    tuple(UPDATE_FORMS),
    _ATTENTION_BODY[8],
    _INTERFACE_CALL + "position_ids=position_ids,**kwargs)",
    "attn_output=attn_output.reshape(bsz,q_len,-1)",
    *_ATTENTION_BODY[-2:],
)
# Cohere's and GLM-4-MoE's attention: the head views, the per-head q/k norms where the
# instance's use_qk_norm says so, the transposes, then as _ATTENTION_BODY from the rotary on
# (Cohere's rotary pairs neighbouring columns, in fp32: _PAIR_ROTARY_STATEMENTS; GLM-4-MoE's is
# the partial rotate_half one over cos's columns, _SPLIT_PARTIAL_ROTARY_BODY)
_PAIR_ROTARY_ATTENTION_BODY = (
    *_ATTENTION_BODY[:2],
    "query_states=self.q_proj(hidden_states).view(hidden_shape)",
    "key_states=self.k_proj(hidden_states).view(hidden_shape)",
    "value_states=self.v_proj(hidden_states).view(hidden_shape)",
    "ifself.use_qk_norm:query_states=self.q_norm(query_states)key_states=self.k_norm(key_states)",
    "query_states=query_states.transpose(1,2)",
    "key_states=key_states.transpose(1,2)",
    "value_states=value_states.transpose(1,2)",
    *_ATTENTION_BODY[5:9],
    _INTERFACE_CALL + "**kwargs)",
    *_ATTENTION_BODY[10:],
)
_PAIR_ROTARY_STATEMENTS = (
    "dtype=q.dtype", "q=q.float()", "k=k.float()", "cos=cos.unsqueeze(unsqueeze_dim)",
    "sin=sin.unsqueeze(unsqueeze_dim)", "q_embed=q*cos+rotate_half(q)*sin", "k_embed=k*cos+rotate_half(k)*sin",
    "return(q_embed.to(dtype=dtype),k_embed.to(dtype=dtype))")
_PAIR_ROTATE_HALF_STATEMENTS = ("x1=x[...,::2]", "x2=x[...,1::2]", "rot_x=torch.stack([-x2,x1],dim=-1).flatten(-2)",
                                "returnrot_x")
# GPT-NeoX's attention: Q/K/V one linear whose columns are [q | k | v] per head (query_key_value),
# viewed per head and chunked, its rotary over the first cos.shape[-1] columns of each head
# (_SPLIT_PARTIAL_ROTARY_BODY), the cache as layer_past, the attention function called with
# scaling first, then dense
_PER_HEAD_ATTENTION_BODY = (
    _ATTENTION_BODY[0],
    "hidden_shape=(*input_shape,-1,3*self.head_size)",
    "qkv=self.query_key_value(hidden_states).view(hidden_shape).transpose(1,2)",
    "query_states,key_states,value_states=qkv.chunk(3,dim=-1)",
    *_ATTENTION_BODY[5:7],
    "iflayer_pastisnotNone:key_states,value_states=layer_past.update(key_states,value_states,self.layer_idx)",
    _ATTENTION_BODY[8],
    "attn_output,attn_weights=attention_interface(self,query_states,key_states,value_states,attention_mask,"
    "scaling=self.scaling,dropout=0.0ifnotself.trainingelseself.attention_dropout,**kwargs)",
    _ATTENTION_BODY[10],
    "attn_output=self.dense(attn_output)",
    _ATTENTION_BODY[-1],
)
PER_HEAD_QKV_NAME = "query_key_value"  # GPT-NeoX's and Falcon's Q/K/V linear
# Falcon's attention (transformers 5.25): Q/K/V one linear whose layout the instance's
# configuration gives (grouped per KV head, [q | k | v] with one KV head, or per head), the rotary
# unless ALiBi, the cache as layer_past, the attention function given position_ids, then dense
_CONFIG_LAYOUT_ATTENTION_BODY = (
    *_ATTENTION_BODY[:2],
    "fused_qkv=self.query_key_value(hidden_states).view(hidden_shape)",
    "ifself.new_decoder_architecture:grouped=fused_qkv.view(*input_shape,self.num_kv_heads,-1,self.head_dim)"
    "query_states=grouped[...,:-2,:].flatten(-3,-2)key_states,value_states=(grouped[...,-2,:],grouped[...,-1,:])"
    "elifself.multi_query:query_states,key_states,value_states=fused_qkv.split([self.num_heads,1,1],dim=-2)"
    "else:query_states,key_states,value_states=fused_qkv.unflatten(-2,(self.num_heads,3)).unbind(-2)",
    "query_states=query_states.transpose(1,2)",
    "key_states=key_states.transpose(1,2)",
    "value_states=value_states.transpose(1,2)",
    "ifnotself.config.alibi:cos,sin=position_embeddingsquery_states,key_states=apply_rotary_pos_emb(query_states,"
    "key_states,cos,sin)",
    _PER_HEAD_ATTENTION_BODY[6],
    _ATTENTION_BODY[8],
    "attn_output,attn_weights=attention_interface(self,query_states,key_states,value_states,attention_mask,"
    "dropout=0.0ifnotself.trainingelseself.attention_dropout,scaling=self.scaling,position_ids=position_ids,"
    "**kwargs)",
    *_PER_HEAD_ATTENTION_BODY[-3:],
)
# Falcon's attention in transformers 5.8-5.24: the same Q/K/V layouts split by its _split_heads
# (_LEGACY_FALCON_SPLIT_BODY; the new architecture's K and V copied to every query head), the
# rotary unless ALiBi, the cache as layer_past, then SDPA called directly (eager: the scores
# divided by sqrt(head_dim), softmax in the activations' dtype), then dense
_LEGACY_FALCON_ATTENTION_BODY = (
    'fused_qkv=self.query_key_value(hidden_states)',
    'num_kv_heads=self.num_headsifself.new_decoder_architectureelseself.num_kv_heads',
    'query_layer,key_layer,value_layer=self._split_heads(fused_qkv)',
    'batch_size,query_length,_,_=query_layer.shape',
    'query_layer=query_layer.transpose(1,2).reshape(batch_size,self.num_heads,query_length,self.head_dim)',
    'key_layer=key_layer.transpose(1,2).reshape(batch_size,num_kv_heads,query_length,self.head_dim)',
    'value_layer=value_layer.transpose(1,2).reshape(batch_size,num_kv_heads,query_length,self.head_dim)',
    'ifalibiisNone:cos,sin=position_embeddingsquery_layer,key_layer=apply_rotary_pos_emb(query_layer,key_layer,cos,'
    'sin)',
    'iflayer_pastisnotNone:key_layer,value_layer=layer_past.update(key_layer,value_layer,self.layer_idx)',
    'kv_length=key_layer.shape[-2]',
    "ifalibiisNone:ifself.config._attn_implementation=='sdpa'and(notoutput_attentions):"
    'is_causal=self.is_causalandattention_maskisNoneand(query_length>1)'
    'attn_output=torch.nn.functional.scaled_dot_product_attention(query_layer,key_layer,value_layer,'
    'attn_mask=attention_mask,dropout_p=0.0,is_causal=is_causal)attention_scores=Noneelse:'
    'attention_scores=query_layer@key_layer.transpose(-1,-2)attention_scores/=math.sqrt(self.head_dim)'
    'attention_scores=F.softmax(attention_scores+attention_mask,dim=-1,dtype=hidden_states.dtype)'
    'attn_output=attention_scores@value_layerattn_output=attn_output.view(batch_size,self.num_heads,query_length,'
    'self.head_dim)attn_output=attn_output.permute(0,2,1,3)attn_output=attn_output.reshape(batch_size,query_length,'
    'self.num_heads*self.head_dim)attn_output=self.dense(attn_output)return(attn_output,attention_scores)else:'
    "ifself.config._attn_implementation=='sdpa'and(notoutput_attentions):"
    'is_causal=self.is_causalandattention_maskisNoneand(query_length>1)'
    'attn_output=torch.nn.functional.scaled_dot_product_attention(query_layer,key_layer,value_layer,'
    'attn_mask=attention_mask,dropout_p=self.attention_dropout.pifself.trainingelse0.0,is_causal=is_causal)'
    'attention_probs=Noneattn_output=attn_output.transpose(1,2)attn_output=attn_output.reshape(batch_size,'
    'query_length,self.num_heads*self.head_dim)attn_output=self.dense(attn_output)else:'
    'matmul_result=query_layer@key_layer.transpose(-1,-2)attention_scores=matmul_result.view(batch_size,'
    'self.num_heads,query_length,kv_length)'
    'input_dtype=attention_scores.dtypeifinput_dtype==torch.float16orinput_dtype==torch.bfloat16:'
    'attention_scores=attention_scores.to(torch.float32)attention_logits=attention_scores+alibi.view(batch_size,'
    'self.num_heads,1,-1)'
    'attention_logits*=self.inv_norm_factorattention_probs=F.softmax(attention_logits+attention_mask,dim=-1,'
    'dtype=hidden_states.dtype)attention_probs=self.attention_dropout(attention_probs)'
    'attention_probs_reshaped=attention_probs.view(batch_size,self.num_heads,query_length,kv_length)'
    'attn_output=(attention_probs_reshaped@value_layer).flatten(0,1)attn_output=self._merge_heads(attn_output)'
    'attn_output=self.dense(attn_output)return(attn_output,attention_probs)',
)
_LEGACY_FALCON_SPLIT_BODY = (
    'ifself.new_decoder_architecture:batch,seq_len,_=fused_qkv.shapeqkv=fused_qkv.view(batch,seq_len,-1,'
    'self.num_heads//self.num_kv_heads+2,self.head_dim)query=qkv[:,:,:,:-2]key=qkv[:,:,:,[-2]]value=qkv[:,:,:,'
    '[-1]]key=torch.broadcast_to(key,query.shape)value=torch.broadcast_to(value,query.shape)query,key,'
    'value=[x.flatten(2,3)forxin(query,key,value)]return(query,key,value)elifnotself.multi_query:batch_size,'
    'seq_length,three_times_hidden_size=fused_qkv.shapefused_qkv=fused_qkv.view(batch_size,seq_length,'
    'self.num_heads,3,self.head_dim)return(fused_qkv[...,0,:],fused_qkv[...,1,:],fused_qkv[...,2,:])else:'
    'batch_size,seq_length,three_times_hidden_size=fused_qkv.shapefused_qkv=fused_qkv.view(batch_size,seq_length,'
    'self.num_heads+2,self.head_dim)return(fused_qkv[...,:-2,:],fused_qkv[...,[-2],:],fused_qkv[...,[-1],:])',
)
# OLMo 2's q/k norms: over all the q (k) columns of the projection, before the head views
_FULL_QK_NORMS = (
    "query_states=self.q_norm(self.q_proj(hidden_states))",
    "key_states=self.k_norm(self.k_proj(hidden_states))",
    "value_states=self.v_proj(hidden_states)",
    "query_states=query_states.view(hidden_shape).transpose(1,2)",
    "key_states=key_states.view(hidden_shape).transpose(1,2)",
    "value_states=value_states.view(hidden_shape).transpose(1,2)",
)
# OLMoE's: the same norms, then Q, K and V clamped to config.clip_qkv where it is set (the
# step takes the layer only where it is None), then the head views
_CLIP_QKV = (
    "ifself.config.clip_qkvisnotNone:query_states.clamp_(min=-self.config.clip_qkv,max=self.config.clip_qkv)"
    "key_states.clamp_(min=-self.config.clip_qkv,max=self.config.clip_qkv)value_states.clamp_(min=-self.config."
    "clip_qkv,max=self.config.clip_qkv)")
_CLIPPED_FULL_QK_NORMS = (
    *_FULL_QK_NORMS[:3], _CLIP_QKV,
    "query_states=query_states.view(*hidden_shape).transpose(1,2)",
    "key_states=key_states.view(*hidden_shape).transpose(1,2)",
    "value_states=value_states.view(*hidden_shape).transpose(1,2)",
)
# Gemma 3's q/k norms: on the head views after the transpose (the same per-head RMSNorm as
# _NORMED_Q / _NORMED_K's before it)
_LATE_QK_NORMS = ("query_states=self.q_norm(query_states)", "key_states=self.k_norm(key_states)")
# Hunyuan's q/k norms: on the rotated head views, after the rotary (AttentionForm.qk_after_rotary)
ROTATED_QK_NORM_NAMES = ("query_layernorm", "key_layernorm")
_ROTATED_QK_NORMS = ("query_states=self.query_layernorm(query_states)", "key_states=self.key_layernorm(key_states)")
# Ministral 3's query scale after the rotary, per position (transformers' get_llama_4_attn_scale,
# statement by statement: _POSITION_SCALE_BODY)
_POSITION_Q_SCALE = ("query_states=query_states*get_llama_4_attn_scale(position_ids,self.config.rope_parameters.get("
                     "'llama_4_scaling_beta'),self.config.rope_parameters.get('original_max_position_embeddings'))"
                     ".to(query_states.dtype)")
_POSITION_SCALE_BODY = ("scaling=1+beta*torch.log(1+torch.floor(positions_ids/max_position_embeddings))",
                        "returnscaling[:,None,:,None]")
# SmolLM3's rotary: run where the instance's use_rope says so (its NoPE layers: none), else
# _ATTENTION_BODY's two statements
_FLAGGED_ROTARY = "ifself.use_rope:" + "".join(_ATTENTION_BODY[5:7])
# Seed-OSS's attention output through a dropout of its residual_dropout (the identity in eval), before
# _ATTENTION_BODY's return (AttentionForm.output_dropout)
_OUTPUT_DROPOUT = "attn_output=nn.functional.dropout(attn_output,p=self.residual_dropout,training=self.training)"
# EXAONE 4's rotary: run where the attention has no window or the layer slides (its global layers:
# none), after _ATTENTION_BODY's cos/sin statement
_SLIDING_ROTARY = "ifself.sliding_windowisNoneorself.is_sliding:" + _ATTENTION_BODY[6]
# Cohere 2's rotary: run where the layer has a window (its global layers: none)
_WINDOWED_ROTARY = "ifself.sliding_windowisnotNone:" + _ATTENTION_BODY[6]
_ROTARY_STATEMENTS = ("q_embed=(q*cos)+(rotate_half(q)*sin)", "k_embed=(k*cos)+(rotate_half(k)*sin)")
# Phi-3's rotary, statement by statement: the first cos.shape[-1] columns of each head rotated,
# the rest passed through (AttentionForm.rotary_by_cos: kv_slot takes cos of any even width up to
# the head's, which the Q/K/V epilogue rotates as this function does)
_PARTIAL_ROTARY_BODY = (
    "cos=cos.unsqueeze(unsqueeze_dim)", "sin=sin.unsqueeze(unsqueeze_dim)", "rotary_dim=cos.shape[-1]",
    "q_rot,q_pass=(q[...,:rotary_dim],q[...,rotary_dim:])", "k_rot,k_pass=(k[...,:rotary_dim],k[...,rotary_dim:])",
    "q_embed=torch.cat([q_rot*cos+rotate_half(q_rot)*sin,q_pass],dim=-1)",
    "k_embed=torch.cat([k_rot*cos+rotate_half(k_rot)*sin,k_pass],dim=-1)", "return(q_embed,k_embed)")
# GPT-NeoX's: the same, the rotated and passed columns concatenated in statements of their own
_SPLIT_PARTIAL_ROTARY_BODY = (
    *_PARTIAL_ROTARY_BODY[:5], "q_embed=q_rot*cos+rotate_half(q_rot)*sin", "k_embed=k_rot*cos+rotate_half(k_rot)*sin",
    "q_embed=torch.cat([q_embed,q_pass],dim=-1)", "k_embed=torch.cat([k_embed,k_pass],dim=-1)",
    "return(q_embed,k_embed)")
# GLM's and Helium's rotary: neighbouring columns paired (_INTERLEAVED_ROTATE_HALF), cos/sin in the
# standard layout, the first half of which each pair's frequency is taken from
# (AttentionForm.cos_halved); Helium's over whole heads, GLM's over the first cos.shape[-1] columns
_HALVED_COS = ("cos=cos[...,:cos.shape[-1]//2].repeat_interleave(2,dim=-1)",
               "sin=sin[...,:sin.shape[-1]//2].repeat_interleave(2,dim=-1)")
_HALVED_PAIR_ROTARY_BODY = (*_PARTIAL_ROTARY_BODY[:2], *_HALVED_COS, "q_embed=q*cos+rotate_half(q)*sin",
                            "k_embed=k*cos+rotate_half(k)*sin", "return(q_embed,k_embed)")
_HALVED_PAIR_PARTIAL_BODY = (*_PARTIAL_ROTARY_BODY[:2], *_HALVED_COS, *_SPLIT_PARTIAL_ROTARY_BODY[2:])
# Ernie 4.5's: GLM's pairs over whole heads, from fp32 copies of q and k and its fp32 cos/sin,
# rounded once (AttentionForm.fp32_halved)
_FP32_HALVED_PAIR_ROTARY_BODY = (
    "original_dtype=q.dtype", *_PARTIAL_ROTARY_BODY[:2], *_HALVED_COS,
    "q_embed=q.float()*cos+rotate_half(q).float()*sin", "k_embed=k.float()*cos+rotate_half(k).float()*sin",
    "return(q_embed.to(original_dtype),k_embed.to(original_dtype))")
_INTERLEAVED_ROTATE_HALF = ("x1=x[...,0::2]", "x2=x[...,1::2]", "returntorch.stack((-x2,x1),dim=-1).flatten(-2)")
_ROTATE_HALF_STATEMENTS = ("x1=x[...,:x.shape[-1]//2]", "x2=x[...,x.shape[-1]//2:]", "returntorch.cat((-x2,x1),dim=-1)")
_STATIC_UPDATE_STATEMENTS = (
    "kv_length=key_states.shape[-2]",
    "cache_position=torch.arange(kv_length,device=self.device)+self.cumulative_length",
    "self.cumulative_length.add_(kv_length)",
    "self.keys.index_copy_(2,cache_position,key_states)",
    "self.values.index_copy_(2,cache_position,value_states)",
    "returnself.keys,self.values",
)
_CACHE_UPDATE_STATEMENTS = ("self.layers[layer_idx].update(key_states,value_states",)
